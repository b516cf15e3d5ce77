"""Structured outputs: grammars compiled off the busy loop, one matcher per constrained request,
and the token bitmask each step ships to the workers (xgrammar)."""
