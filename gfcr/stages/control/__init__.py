"""Control stages."""
