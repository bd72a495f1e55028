"""OpenAI's dialect: the Batch API and webhook endpoints, with OpenAI's words."""
