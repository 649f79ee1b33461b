"""How a forward decides: the per-call choice between a layer's kernel and its original forward.

- ``_dispatch``: the decision, and the generated forwards (the hot path);
- ``_binding``: what kernelpolicy knows of one policy-aware module, and the calls its fast exits do not take;
- ``_failures``: a kernel's failures (``fallback_on``, ``max_failures``, DTensor's), and the lines logged once;
- ``_variants``: kernel variants, and which one a call under a variant entry takes;
- ``_call_fold``: ``module(...)`` in one frame;
- ``_mixing``: one call whose rows follow several policies; ``_step``: a batching step's slots, tables and
  groups of rows; ``_row_join``: a call's rows found from the call, each group's copies, the outputs joined per row;
- ``_verify``: ``verify`` mode's comparison;
- ``_replay``: recomputations take their first run's path;
- ``_persisted``: the policy a persisted compiled program was traced under;
- ``_sharding``: DTensor calls;
- ``_called``: the path of the module being called, for error messages;
- ``_watch``: the one wrapper around the function ``kernels`` binds forwards with.

Imports: ``_context``, ``_kernel_objects``, ``_compat``, ``_attributes``, ``_values``.
"""
