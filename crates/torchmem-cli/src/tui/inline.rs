//! `torchmem run --live`: the live panel in the terminal's bottom rows, under the program's output.
//!
//! The program writes straight to the terminal torchmem shares with it, so a panel that only remembers
//! where it drew (ratatui's `Viewport::Inline`, which also asks the terminal for the cursor position and
//! reads the answer from the program's stdin) would be scrolled away or overwritten by the program's next
//! line. As `status_bar` does for one row, the bottom `height` rows are taken out of the scrolling region
//! (rows 1..N-height scroll, like apt's progress bar), and the ratatui widgets (`view::render_inline`) are
//! drawn there through ratatui's crossterm backend into a buffer that goes out in one `write`, framed by
//! save-cursor / restore-cursor: the terminal serialises whole writes, so the program's lines are never
//! cut, and its cursor (position and colours) is where it left it. The region is removed and the rows
//! cleared at the end, when torchmem is stopped (Ctrl-Z), and set again after a resize.

use std::io::Write;
use std::os::fd::AsRawFd;

use ratatui::backend::{Backend, CrosstermBackend};
use ratatui::buffer::Buffer;
use ratatui::layout::Rect;

use super::view::render_inline;
use torchmem_recorder::live_state::LiveSnapshot;

/// The terminal's (rows, columns) on stderr, if it is one.
fn size() -> Option<(u16, u16)> {
    // SAFETY: TIOCGWINSZ fills the winsize we own.
    unsafe {
        let mut ws: libc::winsize = std::mem::zeroed();
        (libc::ioctl(std::io::stderr().as_raw_fd(), libc::TIOCGWINSZ, &mut ws) == 0).then_some((ws.ws_row, ws.ws_col))
    }
}

fn put(bytes: &[u8]) {
    let mut e = std::io::stderr().lock();
    let _ = e.write_all(bytes);
    let _ = e.flush();
}

/// Collects the backend's output and sends it to stderr in one write, inside save/restore cursor.
#[derive(Default)]
struct Framed {
    buf: Vec<u8>,
}

impl Write for Framed {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            let mut out = Vec::with_capacity(self.buf.len() + 4);
            out.extend_from_slice(b"\x1b7");
            out.append(&mut self.buf);
            out.extend_from_slice(b"\x1b8");
            put(&out);
        }
        Ok(())
    }
}

/// Why the panel cannot be shown here, if it cannot.
pub fn unavailable(height: u16) -> Option<String> {
    // SAFETY: isatty on our own stderr.
    if unsafe { libc::isatty(std::io::stderr().as_raw_fd()) } != 1 {
        return Some("stderr is not a terminal".into());
    }
    if std::env::var("TERM").is_ok_and(|t| t == "dumb" || t.is_empty()) {
        return Some("TERM=dumb".into());
    }
    match size() {
        Some((rows, cols)) if rows >= height + 3 && cols >= 40 => None,
        Some((rows, cols)) => Some(format!("the terminal is too small ({cols}x{rows})")),
        None => Some("the terminal's size is unknown".into()),
    }
}

/// The reserved bottom rows, while set up.
pub struct InlinePanel {
    height: u16,
    rows: u16,
    cols: u16,
    active: bool,
    backend: CrosstermBackend<Framed>,
    /// What is on the screen now (None: unknown, redraw all).
    shown: Option<Buffer>,
    last: Option<LiveSnapshot>,
}

impl InlinePanel {
    /// Reserves the bottom `height` rows of the terminal on stderr (None where `unavailable` says why).
    pub fn start(height: u16) -> Option<InlinePanel> {
        if unavailable(height).is_some() {
            return None;
        }
        let (rows, cols) = size()?;
        let mut p = InlinePanel {
            height,
            rows,
            cols,
            active: false,
            backend: CrosstermBackend::new(Framed::default()),
            shown: None,
            last: None,
        };
        p.setup(true);
        Some(p)
    }

    fn setup(&mut self, new_lines: bool) {
        // New lines first (the region shrinks by `height` rows: what the cursor is on moves up, never under
        // the panel), save the cursor, set the region (this homes the cursor), restore it, step back up.
        let h = self.height;
        let (nl, up) =
            if new_lines { ("\n".repeat(h as usize), format!("\x1b[{h}A")) } else { (String::new(), String::new()) };
        put(format!("{nl}\x1b7\x1b[1;{}r\x1b8{up}", self.rows - h).as_bytes());
        self.active = true;
        self.shown = None;
    }

    fn area(&self) -> Rect {
        Rect { x: 0, y: self.rows - self.height, width: self.cols, height: self.height }
    }

    /// Draws `snap` in the reserved rows (only the cells that changed since the last draw).
    pub fn draw(&mut self, snap: &LiveSnapshot) {
        if !self.active {
            return;
        }
        let area = self.area();
        let mut next = Buffer::empty(area);
        render_inline(area, &mut next, snap);
        let shown = match self.shown.take().filter(|b| b.area == area) {
            Some(b) => b,
            None => {
                // Unknown screen content: clear the rows, then every non-blank cell is drawn.
                let mut clear = Vec::new();
                for r in area.y..area.y + area.height {
                    clear.extend_from_slice(format!("\x1b[{};1H\x1b[2K", r + 1).as_bytes());
                }
                let _ = self.backend.write_all(&clear);
                Buffer::empty(area)
            }
        };
        let _ = self.backend.draw(shown.diff(&next).into_iter());
        let _ = Backend::flush(&mut self.backend);
        self.shown = Some(next);
        self.last = Some(snap.clone());
    }

    /// Removes the region and clears the reserved rows; the cursor stays where the program left it.
    pub fn end(&mut self) {
        if self.active {
            let mut s = String::from("\x1b7\x1b[r");
            for r in self.rows - self.height + 1..=self.rows {
                s.push_str(&format!("\x1b[{r};1H\x1b[2K"));
            }
            s.push_str("\x1b8");
            put(s.as_bytes());
            self.active = false;
        }
    }

    /// Sets the rows up again: after a stop (`new_lines`: the shell wrote its lines), or a resize.
    pub fn resume(&mut self, new_lines: bool) {
        if let Some((rows, cols)) = size() {
            self.end();
            if rows < self.height + 3 || cols < 40 {
                return;
            }
            self.rows = rows;
            self.cols = cols;
            self.setup(new_lines);
            if let Some(last) = self.last.take() {
                self.draw(&last);
            }
        }
    }
}

impl Drop for InlinePanel {
    fn drop(&mut self) {
        self.end();
    }
}
