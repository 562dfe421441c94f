//! Moving a CRIU image directory over `Peer.TransferImages`.

use std::io::Write;
use std::path::{Path, PathBuf};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferry_proto::v1::{ImageChunk, ImagePiece, StoredPages};

use super::EngineError;
use super::compression::Compressor;
use super::pagestore::PageStore;
use crate::memtrack::RangeSet;

/// Chunk size on the wire: well under tonic's 4 MiB message limit.
pub const IMAGE_CHUNK_BYTES: usize = 1 << 20;

/// Image files are plain names inside the image directory.
pub fn valid_image_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
}

/// How much data one message carries at most when small files are packed
/// (peer protocol 3): a 1024-connection process's ~1,000 images cross in a
/// dozen messages, and reading, sending and writing still overlap.
pub const IMAGE_BATCH_BYTES: usize = 256 << 10;

/// How the images are cut into messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// One piece per message (peer protocol 2).
    OnePerMessage,
    /// Pieces packed into messages of up to [`IMAGE_BATCH_BYTES`] (3).
    Batched,
}

impl Packing {
    /// The packing a destination that speaks `version` understands.
    pub fn for_version(version: u32) -> Self {
        if version >= 3 {
            Packing::Batched
        } else {
            Packing::OnePerMessage
        }
    }
}

/// Messages under construction: pieces are appended, and a message goes
/// out once it holds enough.
struct Batcher {
    migration_id: String,
    packing: Packing,
    tx: tokio::sync::mpsc::Sender<ImageChunk>,
    pending: Option<ImageChunk>,
    pending_bytes: usize,
}

impl Batcher {
    fn push(
        &mut self,
        file_name: &str,
        offset: u64,
        data: Vec<u8>,
        stored: Option<StoredPages>,
    ) -> Result<(), EngineError> {
        self.push_piece(ImagePiece {
            file_name: file_name.to_owned(),
            offset,
            data,
            stored,
            ..Default::default()
        })
    }

    /// Pages, compressed as `compressor` says.
    fn push_pages(
        &mut self,
        file_name: &str,
        offset: u64,
        raw: Vec<u8>,
        compressor: &mut Compressor,
        counts: &mut ImageCounts,
    ) -> Result<(), EngineError> {
        let n = raw.len() as u64;
        match compressor.pack(&raw) {
            Some(lz4) => {
                counts.lz4_raw_bytes += n;
                counts.lz4_bytes += lz4.len() as u64;
                counts.bytes += lz4.len() as u64;
                self.push_piece(ImagePiece {
                    file_name: file_name.to_owned(),
                    offset,
                    lz4,
                    lz4_length: n,
                    ..Default::default()
                })?;
            }
            None => {
                counts.bytes += n;
                self.push(file_name, offset, raw, None)?;
            }
        }
        Ok(())
    }

    fn push_piece(&mut self, piece: ImagePiece) -> Result<(), EngineError> {
        let len = piece.data.len() + piece.lz4.len();
        match self.pending.as_mut() {
            None => {
                self.pending = Some(ImageChunk {
                    migration_id: self.migration_id.clone(),
                    file_name: piece.file_name,
                    offset: piece.offset,
                    data: piece.data,
                    more: Vec::new(),
                    stored: piece.stored,
                    lz4: piece.lz4,
                    lz4_length: piece.lz4_length,
                });
            }
            Some(chunk) => chunk.more.push(piece),
        }
        self.pending_bytes += len;
        if self.packing == Packing::OnePerMessage || self.pending_bytes >= IMAGE_BATCH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), EngineError> {
        self.pending_bytes = 0;
        match self.pending.take() {
            Some(chunk) => self
                .tx
                .blocking_send(chunk)
                .map_err(|_| EngineError::StreamClosed("image")),
            None => Ok(()),
        }
    }
}

/// What [`read_images`] sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImageCounts {
    pub files: u32,
    /// Bytes of image data sent.
    pub bytes: u64,
    /// Bytes of the pages images of pre-copied processes: all of them, and
    /// those the destination copied from its store instead.
    pub dumped_page_bytes: u64,
    pub stored_bytes: u64,
    /// Bytes of the pages the dump left out (parent runs: ferry's
    /// held-pages patch), which the destination fills from its store.
    pub left_out_bytes: u64,
    /// Of the pages images' bytes, those that crossed compressed, and
    /// their compressed size (in `bytes`).
    pub lz4_raw_bytes: u64,
    pub lz4_bytes: u64,
}

/// Per pages image: its pieces and its size.
type PagePlans = HashMap<String, (Vec<PagePiece>, u64)>;

/// One piece of a pages image, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PagePiece {
    /// `len` bytes of the file from `offset`, sent.
    Data { offset: u64, len: u64 },
    /// Held by the destination (pre-copied and clean since).
    Stored { offset: u64, stored: StoredPages },
}

/// How to send each pages image of the pre-copied processes: the pages the
/// destination holds (`held`, per PID in its namespace) by reference, the
/// rest as data. Checks each layout against its pages file.
fn plan_pages(dir: &Path, held: &HashMap<u32, RangeSet>) -> Result<(PagePlans, u64), EngineError> {
    let mut plans = HashMap::new();
    let mut left_out = 0u64;
    for (vpid, held) in held {
        let map = ferry_criu_image::pagemap::read_pagemap(dir, *vpid).map_err(|source| {
            EngineError::Image {
                what: "reading the dump's page map",
                source,
            }
        })?;
        let size = map
            .check_pages_file(dir)
            .map_err(|source| EngineError::Image {
                what: "checking the dump's pages",
                source,
            })?;
        let mut pieces = Vec::new();
        let mut stored_bytes = 0;
        for run in &map.runs {
            if run.in_parent() {
                left_out += run.nr_pages * map.page_size;
            }
            let Some(offset) = run.pages_file_offset else {
                continue;
            };
            let start = run.vaddr;
            let end = start + run.nr_pages * map.page_size;
            for (s, e, is_held) in held.split(start, end) {
                let offset = offset + (s - start);
                pieces.push(if is_held {
                    stored_bytes += e - s;
                    PagePiece::Stored {
                        offset,
                        stored: StoredPages {
                            pid: *vpid,
                            vaddr: s,
                            length: e - s,
                        },
                    }
                } else {
                    PagePiece::Data { offset, len: e - s }
                });
            }
        }
        let covered: u64 = pieces
            .iter()
            .map(|p| match p {
                PagePiece::Data { len, .. } => *len,
                PagePiece::Stored { stored, .. } => stored.length,
            })
            .sum();
        if covered != size {
            return Err(EngineError::Images(format!(
                "{}: the page map covers {covered} bytes of {size}",
                map.pages_file
            )));
        }
        tracing::debug!(pid = vpid, file = %map.pages_file, bytes = size, stored_bytes, "pages image plan");
        plans.insert(map.pages_file.clone(), (pieces, size));
    }
    Ok((plans, left_out))
}

/// Streams every file of `dir` as chunks into `tx`, from a blocking thread.
/// The pages images of processes in `held` carry only what the destination
/// lacks (see [`plan_pages`]); pages images are compressed as `compressor`
/// says.
pub fn read_images(
    dir: PathBuf,
    migration_id: String,
    packing: Packing,
    held: &HashMap<u32, RangeSet>,
    compressor: &mut Compressor,
    tx: tokio::sync::mpsc::Sender<ImageChunk>,
) -> Result<ImageCounts, EngineError> {
    let (plans, left_out_bytes) = plan_pages(&dir, held)?;
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .map_err(EngineError::io(format!("listing {}", dir.display())))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut out = Batcher {
        migration_id,
        packing,
        tx,
        pending: None,
        pending_bytes: 0,
    };
    let mut counts = ImageCounts {
        left_out_bytes,
        ..Default::default()
    };
    for name in names {
        let path = dir.join(&name);
        let mut f = std::fs::File::open(&path)
            .map_err(EngineError::io(format!("opening {}", path.display())))?;
        counts.files += 1;
        if let Some((pieces, size)) = plans.get(&name) {
            counts.dumped_page_bytes += size;
            if pieces.is_empty() {
                out.push(&name, 0, Vec::new(), None)?;
            }
            for piece in pieces {
                match piece {
                    PagePiece::Stored { offset, stored } => {
                        counts.stored_bytes += stored.length;
                        out.push(&name, *offset, Vec::new(), Some(*stored))?;
                    }
                    PagePiece::Data { offset, len } => {
                        use std::os::unix::fs::FileExt;
                        let mut at = *offset;
                        while at < offset + len {
                            let n = (offset + len - at).min(IMAGE_CHUNK_BYTES as u64) as usize;
                            let mut buf = vec![0u8; n];
                            f.read_exact_at(&mut buf, at)
                                .map_err(EngineError::io(format!("reading {}", path.display())))?;
                            out.push_pages(&name, at, buf, compressor, &mut counts)?;
                            at += n as u64;
                        }
                    }
                }
            }
            continue;
        }
        // Most images are small (one per TCP connection): a buffer the size
        // of the file, not of a chunk, keeps a thousand of them cheap.
        let size = f.metadata().map(|m| m.len() as usize).unwrap_or(0);
        // The pages of a process that was not pre-copied (total copy).
        let pages = name.starts_with("pages-");
        let mut offset = 0u64;
        loop {
            let mut buf = vec![0u8; size.clamp(1, IMAGE_CHUNK_BYTES)];
            let n = read_full(&mut f, &mut buf)
                .map_err(EngineError::io(format!("reading {}", path.display())))?;
            // An empty file still needs one piece so that it exists there.
            if n == 0 && offset > 0 {
                break;
            }
            buf.truncate(n);
            if pages && n > 0 {
                out.push_pages(&name, offset, buf, compressor, &mut counts)?;
            } else {
                out.push(&name, offset, buf, None)?;
                counts.bytes += n as u64;
            }
            offset += n as u64;
            if n == 0 {
                break;
            }
        }
    }
    out.flush()?;
    Ok(counts)
}

/// A piece's bytes: `data`, or `lz4` decompressed (never both).
fn unpacked<'a>(
    file_name: &str,
    data: &'a [u8],
    lz4: &[u8],
    lz4_length: u64,
) -> Result<std::borrow::Cow<'a, [u8]>, EngineError> {
    if lz4.is_empty() {
        return Ok(std::borrow::Cow::Borrowed(data));
    }
    if !data.is_empty() {
        return Err(EngineError::BadImage(format!(
            "{file_name}: a piece has both data and lz4"
        )));
    }
    super::compression::unpack(lz4, lz4_length)
        .map(std::borrow::Cow::Owned)
        .map_err(|why| EngineError::BadImage(format!("{file_name}: {why}")))
}

/// Reads until `buf` is full or the file ends.
fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Writes incoming chunks into `dir`, checking names and offsets. Blocking
/// (plain file writes on tmpfs): run it off the async runtime.
#[derive(Debug)]
pub struct ImageWriter {
    dir: PathBuf,
    /// Pre-copied pages, for the `stored` pieces.
    store: Option<Arc<Mutex<PageStore>>>,
    current: Option<(String, std::fs::File, u64)>,
    pub files: u32,
    pub bytes: u64,
    /// Bytes copied from the store of pre-copied pages.
    pub stored_bytes: u64,
}

impl ImageWriter {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            store: None,
            current: None,
            files: 0,
            bytes: 0,
            stored_bytes: 0,
        }
    }

    /// Takes `stored` pieces from `store`.
    pub fn with_store(mut self, store: Arc<Mutex<PageStore>>) -> Self {
        self.store = Some(store);
        self
    }

    /// Writes the message's own piece, then the pieces packed after it.
    pub fn write(&mut self, chunk: &ImageChunk) -> Result<(), EngineError> {
        let data = unpacked(&chunk.file_name, &chunk.data, &chunk.lz4, chunk.lz4_length)?;
        self.write_piece(&chunk.file_name, chunk.offset, &data, chunk.stored.as_ref())?;
        for p in &chunk.more {
            let data = unpacked(&p.file_name, &p.data, &p.lz4, p.lz4_length)?;
            self.write_piece(&p.file_name, p.offset, &data, p.stored.as_ref())?;
        }
        Ok(())
    }

    fn write_piece(
        &mut self,
        file_name: &str,
        offset: u64,
        data: &[u8],
        stored: Option<&StoredPages>,
    ) -> Result<(), EngineError> {
        if !valid_image_name(file_name) {
            return Err(EngineError::BadImage(format!(
                "file_name {file_name:?} is not a plain file name"
            )));
        }
        let same = matches!(&self.current, Some((n, _, _)) if n == file_name);
        if !same {
            if offset != 0 {
                return Err(EngineError::BadImage(format!(
                    "{file_name}: first chunk at offset {offset}, expected 0"
                )));
            }
            self.finish_file()?;
            let path = self.dir.join(file_name);
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| {
                    if e.kind() == std::io::ErrorKind::AlreadyExists {
                        EngineError::BadImage(format!("{file_name} sent twice"))
                    } else {
                        EngineError::Io {
                            what: format!("creating {}", path.display()),
                            source: e,
                        }
                    }
                })?;
            self.current = Some((file_name.to_owned(), f, 0));
            self.files += 1;
        }
        let Some((name, f, written)) = self.current.as_mut() else {
            return Err(EngineError::Images("no current image file".into()));
        };
        if offset != *written {
            return Err(EngineError::BadImage(format!(
                "{name}: chunk at offset {offset}, expected {written}"
            )));
        }
        if let Some(stored) = stored {
            if !data.is_empty() {
                return Err(EngineError::BadImage(format!(
                    "{name}: a piece at offset {offset} has both data and stored pages"
                )));
            }
            let Some(store) = self.store.as_ref() else {
                return Err(EngineError::BadImage(format!(
                    "{name}: stored pages, but no pages were pre-copied"
                )));
            };
            crate::sync::lock(store).copy_out(stored, f)?;
            *written += stored.length;
            self.stored_bytes += stored.length;
            return Ok(());
        }
        f.write_all(data)
            .map_err(EngineError::io(format!("writing {name}")))?;
        *written += data.len() as u64;
        self.bytes += data.len() as u64;
        Ok(())
    }

    pub fn finish_file(&mut self) -> Result<(), EngineError> {
        if let Some((name, mut f, _)) = self.current.take() {
            f.flush()
                .map_err(EngineError::io(format!("writing {name}")))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_names_cannot_escape_the_directory() {
        assert!(valid_image_name("pages-1.img"));
        for bad in ["", ".", "..", "../etc/passwd", "a/b", "x\0y"] {
            assert!(!valid_image_name(bad), "{bad:?}");
        }
    }

    /// Sends `src` with `packing` and writes it into a fresh directory;
    /// returns that directory, the reader's counts and the message count.
    async fn send(src: &Path, packing: Packing) -> (tempfile::TempDir, (u32, u64), usize) {
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let dir = src.to_owned();
        let reader = tokio::task::spawn_blocking(move || {
            read_images(
                dir,
                "m".into(),
                packing,
                &HashMap::new(),
                &mut Compressor::new(crate::config::Compression::Off, false),
                tx,
            )
            .map(|c| (c.files, c.bytes))
        });
        let dst = tempfile::tempdir().unwrap();
        let mut w = ImageWriter::new(dst.path());
        let mut messages = 0;
        while let Some(c) = rx.recv().await {
            assert_eq!(c.migration_id, "m");
            w.write(&c).unwrap();
            messages += 1;
        }
        w.finish_file().unwrap();
        let counts = reader.await.unwrap().unwrap();
        assert_eq!((w.files, w.bytes), counts);
        (dst, counts, messages)
    }

    #[test]
    fn compressed_pieces_are_written_as_they_were_and_checked() {
        let dst = tempfile::tempdir().unwrap();
        let mut w = ImageWriter::new(dst.path());
        let mut raw = vec![0u8; 64 << 10];
        raw[100..110].copy_from_slice(b"0123456789");
        let lz4 = crate::engine::compression::pack(&raw).unwrap();
        let c = ImageChunk {
            migration_id: "m".into(),
            file_name: "pages-1.img".into(),
            lz4: lz4.clone(),
            lz4_length: raw.len() as u64,
            more: vec![ImagePiece {
                file_name: "pages-1.img".into(),
                offset: raw.len() as u64,
                data: vec![5; 10],
                ..Default::default()
            }],
            ..Default::default()
        };
        w.write(&c).unwrap();
        w.finish_file().unwrap();
        let mut want = raw.clone();
        want.extend([5; 10]);
        assert_eq!(std::fs::read(dst.path().join("pages-1.img")).unwrap(), want);
        // Both, a wrong length, a damaged block: refused, naming the file.
        for (data, lz4, len) in [
            (vec![1], lz4.clone(), raw.len() as u64),
            (vec![], lz4.clone(), raw.len() as u64 - 1),
            (vec![], lz4[..lz4.len() / 2].to_vec(), raw.len() as u64),
        ] {
            let mut w = ImageWriter::new(dst.path());
            let c = ImageChunk {
                migration_id: "m".into(),
                file_name: "pages-2.img".into(),
                data,
                lz4,
                lz4_length: len,
                ..Default::default()
            };
            match w.write(&c) {
                Err(EngineError::BadImage(why)) => {
                    assert!(why.starts_with("pages-2.img: "), "{why}")
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn round_trips_a_directory_and_rejects_bad_offsets() {
        let src = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("a.img"), vec![7u8; IMAGE_CHUNK_BYTES + 10]).unwrap();
        std::fs::write(src.path().join("empty.img"), b"").unwrap();
        for packing in [Packing::OnePerMessage, Packing::Batched] {
            let (dst, counts, _) = send(src.path(), packing).await;
            assert_eq!(counts, (2, IMAGE_CHUNK_BYTES as u64 + 10));
            assert_eq!(
                std::fs::read(dst.path().join("a.img")).unwrap(),
                std::fs::read(src.path().join("a.img")).unwrap()
            );
            assert!(dst.path().join("empty.img").exists());
        }
        let dst = tempfile::tempdir().unwrap();

        let mut w = ImageWriter::new(dst.path());
        let c = ImageChunk {
            migration_id: "m".into(),
            file_name: "b.img".into(),
            offset: 5,
            data: vec![1],
            more: Vec::new(),
            stored: None,
            ..Default::default()
        };
        assert!(matches!(w.write(&c), Err(EngineError::BadImage(_))));
        let c = ImageChunk {
            migration_id: "m".into(),
            file_name: "../x".into(),
            offset: 0,
            data: vec![1],
            more: Vec::new(),
            stored: None,
            ..Default::default()
        };
        assert!(matches!(w.write(&c), Err(EngineError::BadImage(_))));
        // A packed piece is checked like the message's own.
        let mut w = ImageWriter::new(dst.path());
        let c = ImageChunk {
            migration_id: "m".into(),
            file_name: "c.img".into(),
            offset: 0,
            data: vec![1],
            more: vec![ImagePiece {
                file_name: "../y".into(),
                offset: 0,
                data: vec![2],
                stored: None,
                ..Default::default()
            }],
            stored: None,
            ..Default::default()
        };
        assert!(matches!(w.write(&c), Err(EngineError::BadImage(_))));
    }

    #[tokio::test]
    async fn a_thousand_small_images_cross_in_a_few_messages() {
        // CRIU's images of a 1024-connection process: one small
        // tcp-stream image per connection, and a few large ones.
        let src = tempfile::tempdir().unwrap();
        for i in 0..1024 {
            let data: Vec<u8> = (0..(100 + i % 2000)).map(|b| (b ^ i) as u8).collect();
            std::fs::write(src.path().join(format!("tcp-stream-{i}.img")), data).unwrap();
        }
        std::fs::write(
            src.path().join("pages-1.img"),
            vec![3u8; 3 * IMAGE_BATCH_BYTES],
        )
        .unwrap();
        let (one, one_counts, one_messages) = send(src.path(), Packing::OnePerMessage).await;
        let (batched, counts, messages) = send(src.path(), Packing::Batched).await;
        assert_eq!(counts, one_counts);
        assert_eq!(counts.0, 1025);
        assert_eq!(one_messages, 1025);
        // At most one message per IMAGE_BATCH_BYTES of data, plus the last.
        assert!(
            messages as u64 <= counts.1 / IMAGE_BATCH_BYTES as u64 + 1,
            "{messages} messages for {} bytes",
            counts.1
        );
        for e in std::fs::read_dir(src.path()).unwrap() {
            let name = e.unwrap().file_name();
            let want = std::fs::read(src.path().join(&name)).unwrap();
            assert_eq!(std::fs::read(batched.path().join(&name)).unwrap(), want);
            assert_eq!(std::fs::read(one.path().join(&name)).unwrap(), want);
        }
    }
}
