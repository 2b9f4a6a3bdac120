"""Data files shipped with emapg, and the scripts that make them."""
