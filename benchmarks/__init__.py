"""Lab instruments: micro-benchmarks of single kernels and engine parts, outside the installed
package. Run from the repository root: `python -m benchmarks.<name> --help`. What a user runs
against a server is `prelude bench ...` (src/prelude/bench/)."""
