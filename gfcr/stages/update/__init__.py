"""Update stages."""
