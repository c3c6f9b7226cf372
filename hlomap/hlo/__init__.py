"""HLO front end: IR, parser, printer, graph helpers and capture from jax.jit."""
