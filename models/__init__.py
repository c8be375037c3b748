"""A small decoder-only transformer built on `pallas_fa.flash_attention`."""
