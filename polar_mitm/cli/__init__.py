"""The commands: `polar-mitm` and `polar-train`, their options and their lifecycle."""
