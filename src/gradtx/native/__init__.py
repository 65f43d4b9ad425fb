"""C kernels for the eager CPU path, built on first use with the machine's compiler.

Each gives exactly the numbers of the ATen ops it replaces (checked before first use) and only
saves passes over memory; where a kernel cannot be built or its check fails, gradtx runs the ATen
ops. ``GRADTX_NATIVE=0`` turns them off; :func:`gradtx.native.adam.status` says whether the Adam
kernel is in use, and why not.
"""
