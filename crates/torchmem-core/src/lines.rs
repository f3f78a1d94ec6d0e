//! Line-profile tables: the typed form of the line profiler JSON, text and HTML rendering (placeholder).
