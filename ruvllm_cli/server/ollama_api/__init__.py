"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps,
/api/version) on the engine paths every route shares; docs/design.md, section 25."""
