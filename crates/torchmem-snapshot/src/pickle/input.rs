//! Byte input of the unpickler: buffered reads that count the byte offset (for error messages), and
//! length-bounded reads that grow buffers only as data arrives, so a forged length cannot make it
//! allocate more than the input holds.

use std::io::Read;

use crate::error::PickleError;

/// Buffered reader that counts the byte offset.
pub(super) struct Input<R: Read> {
    inner: R,
    buf: Vec<u8>,
    pos: usize,
    filled: usize,
    consumed: u64,
}

impl<R: Read> Input<R> {
    pub(super) fn new(inner: R) -> Self {
        Input { inner, buf: vec![0; 1 << 20], pos: 0, filled: 0, consumed: 0 }
    }

    pub(super) fn offset(&self) -> u64 {
        self.consumed + self.pos as u64
    }

    pub(super) fn fill(&mut self) -> std::io::Result<bool> {
        if self.pos < self.filled {
            return Ok(true);
        }
        self.consumed += self.filled as u64;
        self.pos = 0;
        self.filled = 0;
        loop {
            match self.inner.read(&mut self.buf) {
                Ok(n) => {
                    self.filled = n;
                    return Ok(n > 0);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    pub(super) fn byte(&mut self) -> Result<Option<u8>, PickleError> {
        if self.pos < self.filled {
            let b = self.buf[self.pos];
            self.pos += 1;
            return Ok(Some(b));
        }
        if !self.fill().map_err(|e| io_err(e, self.offset()))? {
            return Ok(None);
        }
        let b = self.buf[self.pos];
        self.pos += 1;
        Ok(Some(b))
    }

    /// Reads exactly `n` bytes into `out` (appending), growing `out` only as data arrives so a
    /// forged length cannot make us allocate more than the input holds.
    pub(super) fn take_into(
        &mut self,
        mut n: u64,
        out: &mut Vec<u8>,
        what: &'static str,
        op_offset: u64,
    ) -> Result<(), PickleError> {
        while n > 0 {
            if self.pos >= self.filled && !self.fill().map_err(|e| io_err(e, self.offset()))? {
                return Err(PickleError::Truncated { offset: self.offset(), what, op_offset });
            }
            let avail = (self.filled - self.pos) as u64;
            let k = avail.min(n) as usize;
            out.extend_from_slice(&self.buf[self.pos..self.pos + k]);
            self.pos += k;
            n -= k as u64;
        }
        Ok(())
    }

    pub(super) fn fixed<const N: usize>(&mut self, what: &'static str, op_offset: u64) -> Result<[u8; N], PickleError> {
        let mut out = [0u8; N];
        if self.filled - self.pos >= N {
            out.copy_from_slice(&self.buf[self.pos..self.pos + N]);
            self.pos += N;
            return Ok(out);
        }
        let mut v = Vec::with_capacity(N);
        self.take_into(N as u64, &mut v, what, op_offset)?;
        out.copy_from_slice(&v);
        Ok(out)
    }

    /// Reads a text line (protocol 0 arguments), without the trailing newline; at most 4 KiB.
    pub(super) fn line(&mut self, op_offset: u64) -> Result<Vec<u8>, PickleError> {
        let mut out = Vec::new();
        loop {
            match self.byte()? {
                None => return Err(PickleError::Truncated { offset: self.offset(), what: "text argument", op_offset }),
                Some(b'\n') => return Ok(out),
                Some(b) => {
                    if out.len() >= 4096 {
                        return Err(PickleError::Malformed {
                            offset: op_offset,
                            msg: "text argument longer than 4 KiB".into(),
                        });
                    }
                    out.push(b);
                }
            }
        }
    }
}

pub(super) fn io_err(e: std::io::Error, offset: u64) -> PickleError {
    PickleError::Io { offset, msg: e.to_string() }
}
