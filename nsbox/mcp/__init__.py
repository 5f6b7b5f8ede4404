"""``nsbox mcp``: the MCP server (``server``), its tools (``tools``), their schemas (``schemas``),
what the sandbox has installed (``probe``) and the user's review (``review``). Needs the ``mcp``
extra.

No code here: each module is imported by its own name.
"""
