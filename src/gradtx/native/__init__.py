"""C kernels for the eager CPU path, built on first use with the machine's compiler.

Each gives exactly the numbers of the ATen ops it replaces (checked before first use) and only
saves passes over memory; where a kernel cannot be built or its check fails, gradtx runs the ATen
ops. Kernels: :mod:`gradtx.native.adam` (the Adam step), :mod:`gradtx.native.momentum` (the
momentum trace, so ``sgd`` with momentum) and :mod:`gradtx.native.codebook` (the block absmax,
codes and values of ``quantize_state``'s 8- and 4-bit state), :mod:`gradtx.native.stored_adam`
(Adam on those codes) and :mod:`gradtx.native.observed` (``observe``'s statistics, read in the
clip's scaling and tallied by the Adam kernel: the products are ATen's, the sums of squares take
one fixed order of their own) and :mod:`gradtx.native.add` (``apply_updates``' new params);
:mod:`gradtx.native.checks` holds what they share. A pure step's new outputs are stored past the
cache (non-temporal stores, ``streams.h``): the same numbers, without reading each new buffer in first.
``GRADTX_NATIVE=0`` turns them off; each module's ``status()`` says whether its kernel is in use,
and why not.
"""
