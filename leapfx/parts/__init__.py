"""Trained parts on disk: what a recipe inserted and trained, saved beside no model.

One format for every recipe. A parts directory holds safetensors files of state dicts and one
JSON file of metadata, nothing pickled; it is written under a temporary name beside the target
and renamed into place (``leapfx.files.write_atomic``), so a directory with the final name is
always complete. ``io.py`` is the one reader and writer (``write_parts_files``,
``write_module_parts``, ``read_parts_meta``, ``read_meta``, ``load_weights``, ``check_host``,
``host_signature``); each recipe's module names its files and checks:

    recipe            files                                        module
    kangaroo          adapter.safetensors + adapter.json           kangaroo.py (write_adapter)
    m2r2, m2r2_exit   adapter.safetensors + adapter.json           m2r2.py (the same files)
    eagle             eagle_head.safetensors + eagle_head.json     eagle.py
    specee            predictors.safetensors + specee.json,        specee.py
                      with adapter/ or eagle/ (the drafter's own)
    swift             swift.json (a skip set: nothing trained)     swift.py
    a drafter's       draft_vocab.safetensors (the token ranking   draft_vocab.py
    vocabulary        of its training data), beside its files

The JSON object: ``format`` (1 for every kind), ``recipe``, ``options`` (the recipe options
the parts were trained with: ``rewrite.apply(..., parts=dir)`` takes any it is not given from
here and refuses any that differ), ``host`` (``host_signature`` of the model they fit: loading
refuses another), ``parameters``, and what the recipe adds (EAGLE's ``init_layer``, SpecEE's
``report``, swift's ``calibration``, a fit's ``training`` summary). Directories written before
this package existed (``leapfx/assets``, users' saved parts) have these very files and load
unchanged; parts without a ranking load as before (only ``draft_vocab=N`` is refused).

A floor of its own between ``modules/`` and ``passes/``: it reads and writes files and state
dicts, never a graph. The passes that load parts into a rewritten graph are
``passes.load_parts``; the trainers write with these modules.

    >>> write_adapter(adapter, "kangaroo-parts/", recipe="kangaroo", options={"exit_layer": 2},
    ...               host=host_signature(hf_model.config))
    >>> read_adapter_config("kangaroo-parts/")["options"]
    {'exit_layer': 2}
"""
