"""vmpin's own state: the SQLite store and the hook journal in front of it."""
