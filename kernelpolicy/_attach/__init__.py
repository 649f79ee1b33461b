"""What becomes policy-aware: finding the modules, and making each one aware once.

- ``_attach``: the public way in (``attach``, ``kernelize``, the class decorators, rules, failures);
- ``_aware``: policy-aware modules and classes, kept so through ``kernels``;
- ``_class_dispatch``: a policy-aware class's own ``forward``, for FX, which traces a module through its class;
- ``_copies``: kept so through copies and pickles (imported with the package's first torch name, and by ``_attach``);
- ``_autoattach``: ``auto_attach``, for modules ``kernels`` binds outside kernelpolicy.

Imports: ``_forward``, ``_context``, ``_kernel_objects``, ``_compat``, ``_versions``, ``_attributes``, ``_values``.
"""
