"""TaskFlow decorators of the provider."""
