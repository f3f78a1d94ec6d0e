//! Reports: one file per output format, all rendered from a loaded `Profile` and its `analysis::Summary`.

pub mod table;
