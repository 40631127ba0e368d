"""Every environment variable the package reads, declared once (:mod:`.registry`), at the lowest
layer so that any module may read a setting (docs/architecture.md, "Layers")."""
