"""Examples built on kernelpolicy (not part of the installed package)."""
