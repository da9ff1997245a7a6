//! The Parquet writer of a recording: row groups gathered from [`Block`]s and written with the
//! `parquet` crate's file writer, thirteen of the fifteen columns encoded here.
//!
//! Every column but `idx` and `value` is constant over a block (the key of one statistic of one
//! tensor use), and a block holds tens to thousands of rows. The `parquet` crate's encoders take
//! a value per row: its dictionary encoder hashes and compares each row's string (an Arrow
//! dictionary array included), which took 63% of the writer's time for the eight text columns
//! (`perf record -g` of `lab/benches/recorder.rs`, MiniLM's real sketches). Here a key column
//! is kept as runs `(dictionary key, rows)`, one lookup per block, and written as a
//! dictionary-encoded column chunk (the layout the crate writes, with the same encodings; Parquet
//! format, "Encodings": a PLAIN dictionary page, then one data page of `RLE_DICTIONARY` keys in
//! the RLE/bit-packing hybrid, runs only), spliced into the row group with
//! `SerializedRowGroupWriter::append_column`. `idx` and `value` go through the crate's own
//! column writers (DELTA_BINARY_PACKED and BYTE_STREAM_SPLIT, Snappy; see
//! [`super::parquet::writer_properties`]), into pages held in memory until the row group closes,
//! as the crate's `ArrowWriter` holds them.
//!
//! The file carries the same Arrow schema in its metadata as an `ArrowWriter` file (text columns
//! as `Dictionary(Int32, Utf8)`), so every reader sees the same table as before.

use std::collections::HashMap;
use std::fs::File;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use parquet::arrow::{add_encoded_arrow_schema_to_metadata, ArrowSchemaConverter};
use parquet::basic::{Compression, Encoding, EncodingMask};
use parquet::column::page::{CompressedPage, Page, PageWriteSpec, PageWriter};
use parquet::column::writer::{get_column_writer, get_typed_column_writer, ColumnCloseResult, ColumnWriterImpl};
use parquet::data_type::DataType;
use parquet::data_type::{FloatType, Int64Type};
use parquet::errors::ParquetError;
use parquet::file::metadata::{ColumnChunkMetaData, ColumnIndexBuilder, OffsetIndexBuilder};
use parquet::file::page_index::column_index::ColumnIndexMetaData;
use parquet::file::properties::WriterPropertiesPtr;
use parquet::file::statistics::Statistics;
use parquet::file::writer::{SerializedFileWriter, SerializedPageWriter, TrackedWrite};
use parquet::schema::types::{ColumnDescPtr, SchemaDescPtr};

use super::checksum::{Checksum, Summing};
use super::format::{Block, Row, COLUMNS};
use super::parquet::{schema, writer_properties};

/// Rows of `idx` and `value` buffered before they are handed to the crate's column writers
/// (which encode and compress a page at their page limits, [`writer_properties`]).
const ENCODE_ROWS: usize = 4096;

/// The file writer and the Parquet schema of a recording file.
pub(super) struct ParquetFile {
    writer: SerializedFileWriter<Summing<File>>,
}

impl ParquetFile {
    /// Start a recording file (writes the leading magic).
    pub(super) fn create(file: File) -> Result<ParquetFile, ParquetError> {
        let (descr, props) = layout()?;
        Ok(ParquetFile { writer: SerializedFileWriter::new(Summing::new(file), descr.root_schema_ptr(), props)? })
    }

    /// Bytes written to the file so far (closed row groups).
    pub(super) fn bytes_written(&self) -> usize {
        self.writer.bytes_written()
    }

    /// Write `group`'s rows as one row group and empty it. A group without rows writes nothing.
    pub(super) fn write_group(&mut self, group: &mut RowGroup) -> Result<(), ParquetError> {
        if group.rows == 0 {
            return Ok(());
        }
        group.encode_pending()?;
        let rows = group.rows;
        if rows > i32::MAX as usize {
            // A key column's rows are one data page, whose value count is an i32 (Parquet's
            // PageHeader): say so rather than write a wrapped count.
            return Err(ParquetError::General(format!(
                "a run of {rows} recorded values: a Parquet row group of this recorder holds at most 2^31 - 1; \
                 record fewer statistics per run (a pass's `stats=[...]`, or sample runs)"
            )));
        }
        let mut chunks: Vec<(Bytes, ColumnCloseResult)> = Vec::with_capacity(COLUMNS.len());
        let (idx, value) = group.take_writers()?;
        let (mut idx, mut value) = (Some(idx), Some(value));
        for (i, c) in COLUMNS.iter().enumerate() {
            let descr = group.descr.column(i);
            let chunk = match c.name {
                "idx" => idx.take().expect("one idx column").close()?,
                "value" => value.take().expect("one value column").close()?,
                _ => group.keys.column(i).chunk(descr, rows)?,
            };
            debug_assert_eq!(chunk.1.rows_written as usize, rows, "{}", c.name);
            chunks.push(chunk);
        }
        let mut rg = self.writer.next_row_group()?;
        for (bytes, close) in chunks {
            rg.append_column(&bytes, close)?;
        }
        rg.close()?;
        group.rows = 0;
        Ok(())
    }

    /// Write the footer and return the file (not synced) with the checksum of every byte in it.
    pub(super) fn finish(self) -> Result<(File, Checksum), ParquetError> {
        Ok(self.writer.into_inner()?.into_parts())
    }
}

/// The Parquet schema of a recording (from its Arrow schema) and the writer properties, with
/// the Arrow schema stored in the file's metadata as `ArrowWriter` stores it.
fn layout() -> Result<(SchemaDescPtr, WriterPropertiesPtr), ParquetError> {
    let mut props = writer_properties();
    let arrow = schema();
    let descr = ArrowSchemaConverter::new().with_coerce_types(props.coerce_types()).convert(&arrow)?;
    add_encoded_arrow_schema_to_metadata(&arrow, &mut props);
    Ok((Arc::new(descr), Arc::new(props)))
}

/// The rows of one row group being gathered: key columns as runs, `idx` and `value` encoded
/// into pages every [`ENCODE_ROWS`] rows. Memory: the runs (a few words per block), at most
/// [`ENCODE_ROWS`] unencoded rows, and the encoded pages of the group.
pub(super) struct RowGroup {
    descr: SchemaDescPtr,
    props: WriterPropertiesPtr,
    keys: Keys,
    idx: Option<MemColumn<Int64Type>>,
    value: Option<MemColumn<FloatType>>,
    pending_idx: Vec<i64>,
    pending_value: Vec<f32>,
    rows: usize,
}

impl RowGroup {
    /// An empty row group.
    pub(super) fn new() -> Result<RowGroup, ParquetError> {
        let (descr, props) = layout()?;
        Ok(RowGroup {
            descr,
            props,
            keys: Keys::default(),
            idx: None,
            value: None,
            pending_idx: Vec::with_capacity(ENCODE_ROWS),
            pending_value: Vec::with_capacity(ENCODE_ROWS),
            rows: 0,
        })
    }

    /// Rows gathered since the last [`ParquetFile::write_group`].
    pub(super) fn rows(&self) -> usize {
        self.rows
    }

    /// Append the rows of `b` (its non-NaN values).
    pub(super) fn push_block(&mut self, b: &Block<'_>) -> Result<(), ParquetError> {
        let mut n = 0;
        for (i, &x) in b.values.iter().enumerate() {
            if !x.is_nan() {
                self.pending_idx.push(i as i64);
                self.pending_value.push(x);
                n += 1;
            }
        }
        if n > 0 {
            self.keys.push(b, n as u32);
            self.rows += n;
        }
        if self.pending_idx.len() >= ENCODE_ROWS {
            self.encode_pending()?;
        }
        Ok(())
    }

    /// Append one row.
    pub(super) fn push_row(&mut self, r: &Row) -> Result<(), ParquetError> {
        let b = Block {
            run_id: &r.run_id,
            compile: r.compile,
            step: r.step,
            graph: &r.graph,
            pass: &r.pass,
            pass_idx: r.pass_idx,
            site: &r.site,
            op: &r.op,
            role: &r.role,
            stat: &r.stat,
            numel: r.numel,
            shape: &r.shape,
            flops: r.flops,
            values: &[],
        };
        self.keys.push(&b, 1);
        self.pending_idx.push(r.idx as i64);
        self.pending_value.push(r.value);
        self.rows += 1;
        if self.pending_idx.len() >= ENCODE_ROWS {
            self.encode_pending()?;
        }
        Ok(())
    }

    /// Hand the buffered `idx` and `value` rows to the column writers (created on first use).
    fn encode_pending(&mut self) -> Result<(), ParquetError> {
        if self.pending_idx.is_empty() {
            return Ok(());
        }
        if self.idx.is_none() {
            self.idx = Some(MemColumn::new(&self.descr, &self.props, "idx"));
            self.value = Some(MemColumn::new(&self.descr, &self.props, "value"));
        }
        let (idx, value) = (self.idx.as_mut().expect("created"), self.value.as_mut().expect("created"));
        idx.write_batch(&self.pending_idx)?;
        value.write_batch(&self.pending_value)?;
        self.pending_idx.clear();
        self.pending_value.clear();
        Ok(())
    }

    /// The `idx` and `value` writers of the group (the next group gets new ones).
    fn take_writers(&mut self) -> Result<(MemColumn<Int64Type>, MemColumn<FloatType>), ParquetError> {
        let missing = || ParquetError::General("a row group with rows has column writers".into());
        Ok((self.idx.take().ok_or_else(missing)?, self.value.take().ok_or_else(missing)?))
    }
}

/// A crate column writer and the buffer its pages go to ([`MemPages`]).
struct MemColumn<T: DataType> {
    writer: ColumnWriterImpl<'static, T>,
    pages: Arc<Mutex<TrackedWrite<Vec<u8>>>>,
}

impl<T: DataType> MemColumn<T> {
    /// The writer of column `name`.
    fn new(descr: &SchemaDescPtr, props: &WriterPropertiesPtr, name: &str) -> MemColumn<T> {
        let i = COLUMNS.iter().position(|c| c.name == name).expect("a recording column");
        let pages = Arc::new(Mutex::new(TrackedWrite::new(Vec::new())));
        let writer = get_typed_column_writer::<T>(get_column_writer(descr.column(i), props.clone(), Box::new(MemPages(pages.clone()))));
        MemColumn { writer, pages }
    }

    fn write_batch(&mut self, values: &[T::T]) -> Result<usize, ParquetError> {
        self.writer.write_batch(values, None, None)
    }

    /// The chunk's bytes and metadata.
    fn close(self) -> Result<(Bytes, ColumnCloseResult), ParquetError> {
        let close = self.writer.close()?;
        let mut pages = self.pages.lock().map_err(|_| ParquetError::General("page buffer poisoned".into()))?;
        let buf = std::mem::replace(&mut *pages, TrackedWrite::new(Vec::new()));
        Ok((Bytes::from(buf.into_inner()?), close))
    }
}

/// A page writer into memory: the column chunk's bytes from offset 0 (the offsets the crate
/// records in the chunk's metadata are offsets in this buffer, as `append_column` expects).
struct MemPages(Arc<Mutex<TrackedWrite<Vec<u8>>>>);

impl PageWriter for MemPages {
    fn write_page(&mut self, page: CompressedPage) -> Result<PageWriteSpec, ParquetError> {
        let mut sink = self.0.lock().map_err(|_| ParquetError::General("page buffer poisoned".into()))?;
        SerializedPageWriter::new(&mut sink).write_page(page)
    }

    fn close(&mut self) -> Result<(), ParquetError> {
        Ok(())
    }
}

/// A value of a key column: its PLAIN encoding in a dictionary page (Parquet format: a
/// BYTE_ARRAY is a 4-byte little-endian length and the bytes; INT32 and INT64 little-endian).
trait Key: Clone + Eq + Hash {
    fn plain(&self, out: &mut Vec<u8>);
    /// Column statistics from the distinct values (none for text: see `writer_properties`).
    fn statistics(dict: &[Self], nulls: u64) -> Option<Statistics>;
    /// The least and greatest value in the column's sort order as PLAIN bytes, for the page
    /// index (Parquet format, `PageIndex.md`); none for text, as its statistics.
    fn bounds(dict: &[Self]) -> Option<(Vec<u8>, Vec<u8>)>;
}

impl Key for Arc<str> {
    fn plain(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.len() as u32).to_le_bytes());
        out.extend_from_slice(self.as_bytes());
    }
    fn statistics(_: &[Self], _: u64) -> Option<Statistics> {
        None
    }
    fn bounds(_: &[Self]) -> Option<(Vec<u8>, Vec<u8>)> {
        None
    }
}

/// `Key` for an unsigned integer column stored as its signed physical type (`$stats`, `$signed`):
/// UINT_32 as INT32 bits, UINT_64 as INT64 bits, ordered unsigned (Parquet logical types), so
/// min and max are taken unsigned and written as their bits, without the deprecated signed
/// statistics fields.
macro_rules! unsigned_key {
    ($t:ty, $stats:ident, $signed:ty) => {
        impl Key for $t {
            fn plain(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn statistics(dict: &[Self], nulls: u64) -> Option<Statistics> {
                let (lo, hi) = (dict.iter().min().copied(), dict.iter().max().copied());
                Some(Statistics::$stats(lo.map(|v| v as $signed), hi.map(|v| v as $signed), None, Some(nulls), false))
            }
            fn bounds(dict: &[Self]) -> Option<(Vec<u8>, Vec<u8>)> {
                let (lo, hi) = (dict.iter().min()?, dict.iter().max()?);
                Some((lo.to_le_bytes().to_vec(), hi.to_le_bytes().to_vec()))
            }
        }
    };
}

unsigned_key!(u32, int32, i32);
unsigned_key!(u64, int64, i64);

/// Key of a null run.
const NULL: u32 = u32::MAX;

/// One key column of a row group: the distinct values in first-seen order and the rows as runs
/// of `(dictionary key or NULL, length)`.
struct RunColumn<T: Key> {
    dict: Vec<T>,
    index: HashMap<T, u32>,
    /// The last value looked up and its key: consecutive blocks share most keys.
    last: Option<(T, u32)>,
    runs: Vec<(u32, u32)>,
}

impl<T: Key> Default for RunColumn<T> {
    fn default() -> Self {
        RunColumn { dict: Vec::new(), index: HashMap::new(), last: None, runs: Vec::new() }
    }
}

impl<T: Key> RunColumn<T> {
    fn key(&mut self, v: &T) -> u32 {
        if let Some((l, k)) = &self.last {
            if l == v {
                return *k;
            }
        }
        let k = match self.index.get(v) {
            Some(&k) => k,
            None => {
                let k = self.dict.len() as u32;
                self.dict.push(v.clone());
                self.index.insert(v.clone(), k);
                k
            }
        };
        self.last = Some((v.clone(), k));
        k
    }

    fn push_key(&mut self, k: u32, n: u32) {
        match self.runs.last_mut() {
            Some((lk, len)) if *lk == k && len.checked_add(n).is_some() => *len += n,
            _ => self.runs.push((k, n)),
        }
    }

    fn push(&mut self, v: Option<&T>, n: u32) {
        let k = v.map_or(NULL, |v| self.key(v));
        self.push_key(k, n);
    }
}

impl<T: Key> Chunk for RunColumn<T> {
    fn chunk(&mut self, descr: ColumnDescPtr, rows: usize) -> Result<(Bytes, ColumnCloseResult), ParquetError> {
        let optional = descr.max_def_level() > 0;
        let nulls: u64 = self.runs.iter().filter(|r| r.0 == NULL).map(|r| r.1 as u64).sum();
        if !optional && nulls > 0 {
            return Err(ParquetError::General(format!("null in required column {}", descr.name())));
        }
        let mut data = Vec::new();
        if optional {
            // Definition levels (bit width 1), prefixed by their byte length (data page v1).
            let mut levels = Vec::new();
            rle_runs(self.runs.iter().map(|&(k, n)| (u32::from(k != NULL), n)), 1, &mut levels);
            data.extend_from_slice(&(levels.len() as u32).to_le_bytes());
            data.extend_from_slice(&levels);
        }
        let mut sink = TrackedWrite::new(Vec::new());
        let mut pages = SerializedPageWriter::new(&mut sink);
        let mut spec = Vec::new();
        let encoding = if self.dict.is_empty() {
            // Only nulls: a PLAIN page of zero values.
            Encoding::PLAIN
        } else {
            let mut dict = Vec::new();
            self.dict.iter().for_each(|v| v.plain(&mut dict));
            let n = dict.len();
            let page = Page::DictionaryPage { buf: Bytes::from(dict), num_values: self.dict.len() as u32, encoding: Encoding::PLAIN, is_sorted: false };
            spec.push(pages.write_page(CompressedPage::new(page, n))?);
            let width = bit_width(self.dict.len() as u32 - 1);
            data.push(width);
            rle_runs(self.runs.iter().copied().filter(|r| r.0 != NULL), width, &mut data);
            Encoding::RLE_DICTIONARY
        };
        let n = data.len();
        let page = Page::DataPage {
            buf: Bytes::from(data),
            num_values: rows as u32,
            encoding,
            def_level_encoding: Encoding::RLE,
            rep_level_encoding: Encoding::RLE,
            statistics: None,
        };
        spec.push(pages.write_page(CompressedPage::new(page, n))?);
        let (dict_offset, data) = match spec.as_slice() {
            [d, p] => (Some(d.offset as i64), p),
            [p] => (None, p),
            _ => unreachable!("one or two pages"),
        };
        let data_offset = data.offset as i64;
        // The page index, as the crate writes it for its own chunks: the offset index (where
        // the one data page is, from row 0) for every column, the column index (the page's
        // bounds and null count) where the chunk has statistics. Readers that require a page
        // index (`PageIndexPolicy::Required`) refuse a file without it.
        let mut offsets = OffsetIndexBuilder::new();
        offsets.append_offset_and_size(data_offset, data.bytes_written as i32);
        offsets.append_row_count(rows as i64);
        let column_index = if T::statistics(&self.dict, nulls).is_some() {
            let mut b = ColumnIndexBuilder::new(descr.physical_type());
            let (lo, hi) = T::bounds(&self.dict).unwrap_or_default();
            b.append(self.dict.is_empty(), lo, hi, nulls as i64, None);
            Some(b.build()?)
        } else {
            None::<ColumnIndexMetaData>
        };
        let size: u64 = spec.iter().map(|s| s.bytes_written).sum();
        let encodings = [Encoding::PLAIN, Encoding::RLE].into_iter().chain((encoding == Encoding::RLE_DICTIONARY).then_some(encoding));
        let mut meta = ColumnChunkMetaData::builder(descr)
            .set_compression(Compression::UNCOMPRESSED)
            .set_encodings_mask(EncodingMask::new_from_encodings(encodings.collect::<Vec<_>>().iter()))
            .set_total_compressed_size(size as i64)
            .set_total_uncompressed_size(size as i64)
            .set_num_values(rows as i64)
            .set_data_page_offset(data_offset)
            .set_dictionary_page_offset(dict_offset);
        if let Some(s) = T::statistics(&self.dict, nulls) {
            meta = meta.set_statistics(s);
        }
        let close = ColumnCloseResult {
            bytes_written: size,
            rows_written: rows as u64,
            metadata: meta.build()?,
            bloom_filter: None,
            column_index,
            offset_index: Some(offsets.build()),
        };
        *self = RunColumn::default();
        Ok((Bytes::from(sink.into_inner()?), close))
    }
}

/// Bits needed for values up to `max` (0 for 0).
fn bit_width(max: u32) -> u8 {
    (32 - max.leading_zeros()) as u8
}

/// `runs` in the RLE/bit-packing hybrid (Parquet format, "Run Length Encoding / Bit-Packing
/// Hybrid"), RLE runs only: each run is a ULEB128 header `length << 1` and the value in
/// `ceil(width / 8)` little-endian bytes.
fn rle_runs(runs: impl Iterator<Item = (u32, u32)>, width: u8, out: &mut Vec<u8>) {
    let bytes = (width as usize).div_ceil(8);
    for (v, n) in runs.filter(|r| r.1 > 0) {
        let mut h = (n as u64) << 1;
        loop {
            let b = (h & 0x7f) as u8;
            h >>= 7;
            if h == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        }
        out.extend_from_slice(&v.to_le_bytes()[..bytes]);
    }
}

/// The thirteen key columns, in [`COLUMNS`] order without `idx` and `value`.
#[derive(Default)]
struct Keys {
    /// run_id, graph, pass, site, op, role, stat, shape.
    text: [RunColumn<Arc<str>>; 8],
    compile: RunColumn<u32>,
    step: RunColumn<u64>,
    pass_idx: RunColumn<u32>,
    numel: RunColumn<u64>,
    flops: RunColumn<u64>,
}

impl Keys {
    fn push(&mut self, b: &Block<'_>, n: u32) {
        for (c, s) in self.text.iter_mut().zip([b.run_id, b.graph, b.pass, b.site, b.op, b.role, b.stat, b.shape]) {
            c.push(Some(s), n);
        }
        self.compile.push(Some(&b.compile), n);
        self.step.push(Some(&b.step), n);
        self.pass_idx.push(Some(&b.pass_idx), n);
        self.numel.push(b.numel.as_ref(), n);
        self.flops.push(b.flops.as_ref(), n);
    }

    /// The key column at position `i` of [`COLUMNS`].
    fn column(&mut self, i: usize) -> &mut dyn Chunk {
        match COLUMNS[i].name {
            "run_id" => &mut self.text[0],
            "graph" => &mut self.text[1],
            "pass" => &mut self.text[2],
            "site" => &mut self.text[3],
            "op" => &mut self.text[4],
            "role" => &mut self.text[5],
            "stat" => &mut self.text[6],
            "shape" => &mut self.text[7],
            "compile" => &mut self.compile,
            "step" => &mut self.step,
            "pass_idx" => &mut self.pass_idx,
            "numel" => &mut self.numel,
            "flops" => &mut self.flops,
            other => unreachable!("{other} is not a key column"),
        }
    }
}

/// A key column's chunk, whatever its value type.
trait Chunk {
    /// The column chunk of the gathered rows (`rows` of them), and the column emptied.
    fn chunk(&mut self, descr: ColumnDescPtr, rows: usize) -> Result<(Bytes, ColumnCloseResult), ParquetError>;
}
