"""What the ops take in, by the input pipeline's stages, in order: ``validate`` (the forms,
dtypes and sizes users pass, checked), ``normalise`` (one canonical CSR over flat int32 ids),
``oob`` (each position's table and the out-of-range policy; the bag ops' entry), ``pack``
(the pooling modes; unpooled bags); and the keyed jagged batch of a collection (``jagged``)."""
