"""What the ops take in: ids and the out-of-range policy (``oob``), the bag forms and their
canonical CSR (``bag``), the keyed jagged batch of a collection (``jagged``)."""
