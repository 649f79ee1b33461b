"""What tells the user what happened, or what will: reports on policy-aware models.

- ``_explain``: which path each kernel layer would take now (``explain``, ``will_use_kernel``);
- ``_accounting``: how many calls took each path, and why (``record_calls``);
- ``_warmup``: compiled programs made up front for a set of policies;
- ``_doctor``: ``python -m kernelpolicy doctor``.

Imports: ``_attach``, ``_forward``, ``_context``, ``_compat``, ``_versions``, ``_attributes``, ``_values``.
"""
