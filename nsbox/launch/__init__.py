"""Stage 3, the host side of a launch: the plain launch through the helper (``launcher``) and
the pool of sandboxes built ahead (``pool``).

No code here: each module is imported by its own name.
"""
