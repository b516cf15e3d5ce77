"""The built-in web page of `engine serve`: a live engine view, the last requests' timelines and
a playground (docs/ui.md)."""
