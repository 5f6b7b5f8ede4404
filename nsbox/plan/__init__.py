"""Stage 2: a policy made into one run's plan (``plan``), or the Landlock mode's (``landlock``).

No code here: each module is imported by its own name.
"""
