"""Output text parsers: reasoning/ (<think> blocks) and tool/ (function calls), each a base with a
registry and one file per format; chat.py chains them; types.py holds the plain results."""
