"""Filter stages."""
