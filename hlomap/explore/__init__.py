"""See ../shared/DESIGN.md for what this subpackage holds."""
