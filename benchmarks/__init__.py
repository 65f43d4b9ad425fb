"""gradtx's benchmarks (a package, so that ``benchmarks.common`` is this folder's module even where
another distribution, such as jsonschema, installs a top-level ``benchmarks`` package)."""
