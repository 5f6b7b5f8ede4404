"""Many commands in one sandbox: ``Session`` (``session``), its files (``files``), a project's
review (``review``), its arguments and policy (``policy``), ``Session.run`` (``run``) and a
published session's supervisor (``supervisor``).

No code here: each module is imported by its own name.
"""
