//! journey (placeholder)
