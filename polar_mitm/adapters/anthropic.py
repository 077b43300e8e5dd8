"""Placeholder: being written."""
STYLE = "anthropic"
