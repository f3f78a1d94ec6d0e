//! `torchmem run --status`: a live status line that never mixes with the program's output. The program
//! shares torchmem's terminal, so a repainted line (`\r`…) would glue itself to whatever the program prints
//! next; instead the bottom row of the terminal is reserved (a scrolling region of rows 1..N-1, as apt's
//! progress bar does) and the line is drawn there with the cursor saved and restored, in one `write` each
//! (a terminal serialises whole writes, so a program's line is never cut by ours). Off by default: without
//! `--status`, torchmem prints only its summary at the end. The region is removed when the run ends, when
//! torchmem stops (Ctrl-Z), and set again after a resize.

use std::io::Write;
use std::os::fd::AsRawFd;

/// The terminal's (rows, columns) on stderr, if it is one.
fn size() -> Option<(u16, u16)> {
    // SAFETY: TIOCGWINSZ fills the winsize we own.
    unsafe {
        let mut ws: libc::winsize = std::mem::zeroed();
        (libc::ioctl(std::io::stderr().as_raw_fd(), libc::TIOCGWINSZ, &mut ws) == 0 && ws.ws_row >= 3)
            .then_some((ws.ws_row, ws.ws_col))
    }
}

fn put(s: &str) {
    let mut e = std::io::stderr().lock();
    let _ = e.write_all(s.as_bytes());
    let _ = e.flush();
}

/// The reserved bottom row, while set up.
pub struct StatusBar {
    rows: u16,
    cols: u16,
    active: bool,
    last: String,
}

impl StatusBar {
    /// Reserves the bottom row of the terminal on stderr (None when stderr is not a terminal, or too small).
    pub fn start() -> Option<StatusBar> {
        let (rows, cols) = size()?;
        let mut bar = StatusBar { rows, cols, active: false, last: String::new() };
        bar.setup(true);
        Some(bar)
    }

    fn setup(&mut self, new_line: bool) {
        // A new line first (the region shrinks by one row), save the cursor, set the region (this homes the
        // cursor), restore the cursor and step back up into the region.
        let nl = if new_line { "\n" } else { "" };
        let up = if new_line { "\x1b[1A" } else { "" };
        put(&format!("{nl}\x1b7\x1b[1;{}r\x1b8{up}", self.rows - 1));
        self.active = true;
    }

    /// Draws `text` in the reserved row, cut to the terminal's width.
    pub fn draw(&mut self, text: &str) {
        if !self.active {
            return;
        }
        let cut: String = text.chars().take(self.cols.saturating_sub(1) as usize).collect();
        put(&format!("\x1b7\x1b[{};1H\x1b[2K{cut}\x1b8", self.rows));
        self.last = cut;
    }

    /// Removes the region and clears the reserved row; the cursor stays where the program left it.
    pub fn end(&mut self) {
        if self.active {
            put(&format!("\x1b7\x1b[r\x1b[{};1H\x1b[2K\x1b8", self.rows));
            self.active = false;
        }
    }

    /// Sets the region up again: after a stop (`new_line`, the shell wrote its lines), or a resize.
    pub fn resume(&mut self, new_line: bool) {
        if let Some((rows, cols)) = size() {
            self.end();
            self.rows = rows;
            self.cols = cols;
            self.setup(new_line);
            let last = std::mem::take(&mut self.last);
            self.draw(&last);
        }
    }
}

impl Drop for StatusBar {
    fn drop(&mut self) {
        self.end();
    }
}
