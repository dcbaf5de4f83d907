"""Tests of the heads' checkpoint format: save and load, the Hub, Medusa import, vLLM export,
safe folder writes."""
