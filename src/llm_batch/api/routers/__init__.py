"""One router per resource; each is thin: parse, authorise, call the use case, translate."""
