"""inferlets: the WIT world, wasmtime host and guest SDK (not built yet; see ARCHITECTURE.md)."""
