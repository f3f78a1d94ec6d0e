//! recorder (placeholder)
