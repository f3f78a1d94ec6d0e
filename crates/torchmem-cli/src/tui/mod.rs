//! The live view (`torchmem top`, `torchmem run --live`): `state` folds the recorder's records into the
//! latest readings of one run (the `LiveSnapshot` a recorder publishes) and holds the viewer's pure state
//! (runs, sort, selection); `view` draws them with ratatui widgets into a buffer (full screen, inline panel,
//! or plain text for a dumb terminal); `inline` keeps the bottom rows of `run`'s terminal for the panel.

pub mod inline;
pub mod state;
pub mod view;
