"""Test-model tooling: the random tiny/small models and the corpus their tokenizers learn."""
