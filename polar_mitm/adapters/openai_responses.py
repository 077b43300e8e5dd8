"""Placeholder: being written."""
STYLE = "openai_responses"
