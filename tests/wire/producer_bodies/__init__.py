"""Response bodies built the way each producer's own serializer builds them.

Each module reproduces one producer's serializer (field paths, field order, encodings, dtype
choice, clipping, null cases) from its public source; every function's docstring cites the
repository, path, version and function it follows. /work/notes/producers.md has the facts;
README.md in this folder says how to use the builders.
"""
