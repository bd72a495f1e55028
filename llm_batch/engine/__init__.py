"""Package marker (contents land with their issue)."""
