"""The bundled DeepSeek V3/V3.2 decode engine (issue 3). Nothing is implemented here yet."""
