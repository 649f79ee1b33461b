"""What a policy is: values that know nothing of what is running.

- ``_errors``: the exceptions kernelpolicy raises, and where a warning points;
- ``_exceptions``: the exception types a policy's ``fallback_on`` names;
- ``_policy``: modes, :class:`~kernelpolicy.Policy` and its text syntax;
- ``_rules``: what a kernel accepts per call (``kernel_accepts``);
- ``_tensors``: the walk over the tensors of a call's structure;
- ``_text``: plain-text tables.

Imports: the standard library and torch only (the floor of the house; ``pyproject.toml`` holds the order inside).
"""
