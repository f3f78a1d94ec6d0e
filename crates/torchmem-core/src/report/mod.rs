//! Reports (placeholder replaced below)
