"""Command-line tools over the library: `python tools/NAME.py --help`; each is importable as tools.NAME."""
