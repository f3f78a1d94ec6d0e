//! Analysis (placeholder replaced below)
