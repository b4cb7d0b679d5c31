"""``kvcompress serve``: an OpenAI-compatible server that keeps long contexts compressed (needs the ``serve``
extra). ``engine`` (the model worker), ``store`` (resident compressed contexts), ``protocol`` (schemas, errors),
``app`` (FastAPI routes), ``metrics`` (Prometheus), ``cli`` (the command)."""
