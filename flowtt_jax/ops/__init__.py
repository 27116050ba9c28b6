"""The ops: TT embedding bags and lookups of one table or of a shape group of tables, over
the kernels or the reference, with their VJPs; the dense-table twins (``dense``)."""
