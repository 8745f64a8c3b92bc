"""Generate stages."""
