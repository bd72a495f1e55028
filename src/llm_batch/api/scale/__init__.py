"""Scale's dialect: batch completions (v1 and v2), with Scale's words."""
